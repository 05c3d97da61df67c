"""What a local launcher's forkserver loads once, so that every worker it forks starts with it.

A local worker is forked from the launcher's ``forkserver``: whatever the forkserver imported and
warmed up is in the worker at no cost. Without it, each worker pays for itself, on the cores the
serving ranks decode on, and a joining rank's start is the longest part of a scale up's draining:

- torch and the worker module: about 1-2 s of CPU;
- the placement algorithm's compiled kernels, loaded from numba's on-disk cache: 0.5 s (the
  worker's warm-up thread then finds them loaded);
- for a Hugging Face model, transformers and the parts of it that building a model imports
  (masking, activations, model loading, through torch's dynamo): about 2-3 s
  (``HF_MODULES`` in :mod:`elastic.launch.launchers`, preloaded beside this module only for a
  deployment whose model is ``hf``).

Importing this module has those effects: the launcher names it in ``set_forkserver_preload``, and
nothing imports it. The coordinator compiles the kernels before it launches a worker (``Coordinator.start``),
so here they only load.
"""

from __future__ import annotations

import torch  # noqa: F401  # loaded for every worker forked after this

import elastic.worker.process  # noqa: F401
from eplb.algorithm import warm_up

warm_up()
