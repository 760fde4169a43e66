"""Training frameworks' callbacks around ``convcheck.watch`` (optional extras, issue 25).

``lightning.ConvcheckCallback`` (``pip install 'convcheck[lightning]'``) and ``hf.ConvcheckCallback``
(``pip install 'convcheck[hf]'``) each open a ``convcheck.watch`` on the trainer's model and optimizer when
training starts and close it when training ends, recording the loss the framework computed. Only these
modules import their framework: ``import convcheck`` never imports lightning or transformers, and a missing
extra is a one-line ``UsageError`` naming the ``pip install`` that adds it (``_extra.require``).
"""
