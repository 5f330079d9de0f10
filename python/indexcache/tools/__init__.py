"""What one does with a DSA checkpoint beyond serving it: ``patterns`` (overlap, greedy search,
evaluation of F/S patterns), ``train`` (the DSA recipe on the standard library's text, ``text``),
``aware`` (training-aware IndexCache, its loss in ``aware_loss``, its held-out table in
``aware_table``). Every one of them runs the model's own blocks (``hidden_states``, the
layers' ``forward``), with the kernels or, where gradients are needed, under a ``TorchPass``."""
