"""Development tools of the kvcached repository (not part of the installed package).

Import them from the repository root: ``from tools.tiny_model import make_tiny_llama``.
"""
