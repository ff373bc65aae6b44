"""tf_hwopt: cheaper Keras/TensorFlow training on TPUs and GPUs.

Example:
>>> import tf_hwopt
>>> model.fit(x, y, epochs=20, callbacks=[tf_hwopt.EgeriaCallback()])
"""

from tf_hwopt._quiet import import_tensorflow_quietly as _import_tf

_import_tf()

from tf_hwopt import egeria  # noqa: E402
from tf_hwopt.egeria import EgeriaCallback, FreezeOutCallback, GradientNormFreezeCallback  # noqa: E402

__version__ = "0.1.0"
