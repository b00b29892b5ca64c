"""Offline trainers: SFT, the reward model and the DPO family, each a few functions over one loop (``loop.py``)."""
