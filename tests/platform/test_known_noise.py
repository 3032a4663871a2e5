"""quiet_known_warnings drops the known messages of torch and Megatron-Core 0.16 to 0.19, and only those."""
from __future__ import annotations

import logging
import warnings

from megarl.platform import KNOWN_LOG_NOISE, quiet_known_warnings


def test_known_log_records_are_dropped_and_others_kept(caplog):
    quiet_known_warnings()
    caplog.set_level(logging.WARNING)
    logging.getLogger("megatron.core.models.gpt.gpt_model").warning(
        "GPTModel IS DEPRECATED. GPTModel is only accepting critical bug fixes, no new features.")
    logging.getLogger("torch.utils.cpp_extension").warning("No CUDA runtime is found, using CUDA_HOME='%s'", "/usr/local")
    logging.getLogger("megatron.core.distributed.distributed_data_parallel").warning("a real problem in DDP")
    assert [r.getMessage() for r in caplog.records] == ["a real problem in DDP"]
    assert set(KNOWN_LOG_NOISE) >= {"megatron.core.models.gpt.gpt_model", "torch.utils.cpp_extension"}


def test_known_warnings_are_ignored_and_others_raised():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_known_warnings()  # inserted in front of "always"
        warnings.warn("absl.logging is not installed. Using logging.getLogger(__name__) instead.", UserWarning)
        warnings.warn("MimoModelConfig is experimental and still under active development.", UserWarning)
        warnings.warn("something megarl should hear about", UserWarning)
    assert [str(w.message) for w in caught] == ["something megarl should hear about"]
