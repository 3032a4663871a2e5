"""python -m megarl.tools.export_hf --ckpt RUN/checkpoints/step_XXXXXXXX --out DIR [--role actor|critic]

Writes a checkpoint's model as a Hugging Face directory that `transformers` loads. Runs on any
number of processes (the checkpoint reshards); one is enough.
"""
import sys

from megarl.checkpointing.checkpoint import export_hf_main

if __name__ == "__main__":
    sys.exit(export_hf_main())
