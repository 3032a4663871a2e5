"""megarl.agents.chat: an episode built turn by turn (sampled policy tokens, observations rendered
by the template) equals the chat template's rendering of the whole conversation, for each family's
tokenizer the tests build (tiny_models) with a template in that family's form; where it cannot
(a template that rewrites earlier turns, sampled tokens that are not their text's encoding, an
observation encoded without the template's separator, verl #6921), the check counts the tokens
and names the boundary.

The tiny tokenizers carry no chat template (nothing is downloaded): each test gives its family's
form, written here after the published templates: ChatML (Qwen2), Qwen3 (drops the reasoning of
past assistant turns), Llama 3 (header ids, <|eot_id|>), Mistral/Mixtral ([INST], eos)."""
from __future__ import annotations

import pytest

from conftest import FAMILIES
from megarl.agents.chat import ChatTurns

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
QWEN3 = ("{% for m in messages %}{% set c = m.content %}"
         "{% if m.role == 'assistant' and not loop.last and '</think>' in c %}{% set c = c.split('</think>')[-1].lstrip('\n') %}{% endif %}"
         "<|im_start|>{{ m.role }}\n{{ c }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3 = ("<|begin_of_text|>{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
          "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
MISTRAL = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }} [/INST]"
           "{% elif m.role == 'assistant' %}{{ m.content }}{{ eos_token }}{% else %}[TOOL_RESULTS] {{ m.content }} [/TOOL_RESULTS]"
           "{% endif %}{% endfor %}")
# family -> (template, special tokens it needs, the token a policy turn stops on)
FORMS = {"qwen2": (CHATML, ["<|im_start|>", "<|im_end|>"], "<|im_end|>"),
         "qwen3": (QWEN3, ["<|im_start|>", "<|im_end|>"], "<|im_end|>"),
         "qwen3_moe": (QWEN3, ["<|im_start|>", "<|im_end|>"], "<|im_end|>"),
         "llama": (LLAMA3, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|eot_id|>"),
         "mixtral": (MISTRAL, ["[INST]", "[/INST]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], "<eos>")}
ANSWERS = ["I will look it up.", "The total is 42."]
OBSERVATION = "Result: 42"


def _tokenizer(tiny_models, family):
    from transformers import AutoTokenizer

    template, specials, stop = FORMS[family]
    tok = AutoTokenizer.from_pretrained(tiny_models[family])
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template = template
    return tok, tok.convert_tokens_to_ids(stop)


def _episode(chat, tok, stop, answers=ANSWERS, turn_ids=None, observe=None):
    """Build prompt, policy turns (their tokens as a policy would sample them) and observations
    turn by turn, as megarl.rollout.multi_turn does; returns (messages, built ids, segments)."""
    messages = [{"role": "user", "content": "What is 6 * 7?"}]
    built = chat.prompt_ids(messages)
    segments = [("prompt", len(built))]
    for k, answer in enumerate(answers):
        ids = (turn_ids or (lambda text: tok.encode(text, add_special_tokens=False)))(answer) + [stop]
        built += ids
        messages.append({"role": "assistant", "content": answer})
        segments.append((f"assistant turn {k}", len(ids)))
        if k < len(answers) - 1:
            obs = (observe or chat.observation_ids)(messages, ids, OBSERVATION)
            built += obs
            messages.append({"role": "tool", "content": OBSERVATION})
            segments.append((f"tool turn {k}", len(obs)))
    return messages, built, segments


@pytest.mark.parametrize("family", FAMILIES)
def test_turn_by_turn_equals_the_template(tiny_models, family):
    tok, stop = _tokenizer(tiny_models, family)
    chat = ChatTurns(tok)
    messages, built, segments = _episode(chat, tok, stop)
    check = chat.check(messages, built, segments)
    assert check.ok, check.warning()
    reference = tok.apply_chat_template(messages, tokenize=True)
    reference = reference["input_ids"] if hasattr(reference, "keys") else reference
    assert built == list(reference)[: len(built)] and len(reference) - len(built) <= 2  # the template's own trailing separator


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_observation_without_the_templates_separator_is_named(tiny_models, family):
    # verl #6921: the tool turn rendered on its own, after a policy that stopped at <|im_end|> /
    # <|eot_id|>: ChatML's "\n" after <|im_end|> is lost at every boundary
    tok, stop = _tokenizer(tiny_models, family)
    chat = ChatTurns(tok)

    def alone(messages, ids, observation):
        text = chat.render([{"role": "tool", "content": observation}], add_generation_prompt=True)
        return tok.encode(text.replace("<|begin_of_text|>", ""), add_special_tokens=False)

    messages, built, segments = _episode(chat, tok, stop, observe=alone)
    check = chat.check(messages, built, segments)
    if family == "llama":  # Llama 3's header ids need no separator: rendering alone is exact there
        assert check.ok, check.warning()
        return
    assert not check.ok and check.boundary == "tool turn 0"
    assert check.template_token == tok.encode("\n", add_special_tokens=False)[0]
    assert check.warning().startswith(f"chat template: {check.mismatched} token(s) of the episode differ from the template's "
                                      f"rendering, first at token {check.position} in tool turn 0")


def test_a_template_that_drops_past_reasoning_is_counted(tiny_models):
    # NeMo-RL #2821: Qwen3's template drops the <think> of earlier assistant turns; the policy saw it
    tok, stop = _tokenizer(tiny_models, "qwen3")
    chat = ChatTurns(tok)
    answers = ["<think>look it up</think>I will look it up.", "The total is 42."]
    messages, built, segments = _episode(chat, tok, stop, answers=answers)
    check = chat.check(messages, built, segments)
    assert not check.ok and check.boundary == "assistant turn 0" and check.mismatched > 5


def test_sampled_tokens_that_are_not_their_texts_encoding_are_counted(tiny_models):
    # the policy may sample "42" as "4", "2" where the tokenizer encodes "42" as one token:
    # re-encoding the text would train on tokens the policy never sampled
    tok, stop = _tokenizer(tiny_models, "qwen2")
    chat = ChatTurns(tok)
    by_char = lambda text: [tok.convert_tokens_to_ids(tok.convert_ids_to_tokens(tok.encode(c))[0]) for c in text]  # noqa: E731
    assert by_char(ANSWERS[1]) != tok.encode(ANSWERS[1])
    messages, built, segments = _episode(chat, tok, stop, turn_ids=by_char)
    check = chat.check(messages, built, segments)
    assert not check.ok and check.boundary == "assistant turn 0"


def test_a_tokenizer_without_a_template_is_refused(tiny_models):
    from transformers import AutoTokenizer

    with pytest.raises(ValueError, match="rollout.multi_turn.chat_template=false"):
        ChatTurns(AutoTokenizer.from_pretrained(tiny_models["qwen2"]))
