"""Tiny Hugging Face checkpoints written with numpy + safetensors (no torch)."""
