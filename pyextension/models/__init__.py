"""Models built from zerofuse's ops, used by the tests, the benchmarks and the training job."""
from zerofuse.models.gpt import GPT
from zerofuse.models.presets import PRESETS, GPTConfig, config

__all__ = ["GPT", "GPTConfig", "PRESETS", "config"]
