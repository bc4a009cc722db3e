"""Loggers under vLLM's "vllm" namespace, so plugin lines reach vLLM's handler and format."""

from vllm.logger import init_logger


def get_logger(name: str):
    return init_logger(f"vllm.{name}")
