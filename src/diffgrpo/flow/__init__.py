"""The flow-matching family (``family.py``); its kernels live in ``samplers/``, its engines in ``engines/``."""
