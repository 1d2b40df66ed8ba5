"""deepseek41: a JAX/Flax training framework for the DeepSeek-V4.1-Flash architecture."""

__version__ = '0.1.0'
