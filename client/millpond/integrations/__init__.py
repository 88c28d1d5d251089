"""Adapters that put millpond under other frameworks' replay-buffer interfaces.

Each submodule imports its framework when it is imported, never before:
``import millpond`` (and ``import millpond.integrations``) loads none of them.

* :mod:`millpond.integrations.sb3`: Stable-Baselines3's ``ReplayBuffer`` and
  ``DictReplayBuffer`` (``pip install 'millpond[sb3]'``).
* :mod:`millpond.integrations.objectrl`: objectrl's TensorDict ``ReplayBuffer``
  (``pip install 'millpond[objectrl]'``).
* :mod:`millpond.integrations.torchrl`: a TorchRL ``Storage`` and samplers drawn by
  millpond, for ``ReplayBuffer`` and ``TensorDictReplayBuffer``
  (``pip install 'millpond[torchrl]'``).
"""
