"""Training drivers around a freezing callback.

`fit_with_cache` (forward skipping: the frozen prefix's outputs are cached
and only the suffix trains) and `fit_multi_worker` (a custom loop under
`MultiWorkerMirroredStrategy`, the chief deciding). Both take
`(model, x, y, *, epochs, batch_size, freezer, validation_data, callbacks,
seed, verbose, ...)` and return a `TrainingResult`; they reach the callback
only through its public hooks. `epoch_dataset` is the pipeline
`fit_with_cache` trains on, for a plain `model.fit` over the same batches.
"""

from tf_hwopt.training.cache import ActivationCache, epoch_dataset, fit_with_cache
from tf_hwopt.training.multiworker import fit_multi_worker
from tf_hwopt.training.result import TrainingResult
