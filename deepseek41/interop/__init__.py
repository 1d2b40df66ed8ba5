"""Hugging Face interop: the `deepseek_v41` checkpoint format in and out (docs/hf_interop.md)."""
