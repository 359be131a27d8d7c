"""Masked diffusion LMs: tasks with verifiable rewards, likelihood estimators and GRPO base methods."""
