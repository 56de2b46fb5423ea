"""Hooks into training frameworks, each an optional extra (docs/training.md, "Hugging Face
and Lightning").

* :mod:`.hf_trainer`: a ``transformers.Trainer`` callback (``pip install 'swarmavg[hf]'``);
* :mod:`.lightning_callback`: a PyTorch Lightning callback (``pip install
  'swarmavg[lightning]'``).

This package imports neither library itself: importing one of its modules without its
extra raises an ``ImportError`` that names the extra to install.
"""
