"""Lily: fast local inference of Qwen3.5/3.6-35B-A3B."""
