"""Keeps TensorFlow's start-up log noise out of what users see.

TensorFlow's C++ runtime prints oneDNN and CUDA-stub notices to file
descriptor 2 before `absl` logging is initialised, so neither
`TF_CPP_MIN_LOG_LEVEL` nor Python's `logging` can silence them. The only
reliable place to stop them is the file descriptor itself, for the duration
of the imports. Real errors still surface: an exception raised by an import
is re-raised after stderr is restored.

Set `TF_HWOPT_VERBOSE_TF=1` to see everything TensorFlow prints.
"""

import contextlib
import logging
import os
import sys
import threading
import warnings


@contextlib.contextmanager
def stderr_silenced():
    if os.environ.get("TF_HWOPT_VERBOSE_TF"):
        yield
        return
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, ValueError, OSError):  # pytest capture, notebooks
        yield
        return
    sys.stderr.flush()
    saved = os.dup(fd)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, fd)
        os.close(saved)
        os.close(devnull)


def import_tensorflow_quietly() -> None:
    """Imports TensorFlow, Keras and tf_keras with their start-up noise hidden."""
    if not os.environ.get("TF_HWOPT_VERBOSE_TF"):
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    already = "tensorflow" in sys.modules
    with stderr_silenced() if not already else contextlib.nullcontext():
        import tensorflow as tf  # noqa: F401
        import keras  # noqa: F401

        # Device discovery prints a CUDA notice on hosts without a GPU.
        tf.config.list_physical_devices()
    tf.get_logger().setLevel(logging.ERROR)
    logging.getLogger("absl").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module=r"tensorflow_model_optimization.*")
    warnings.filterwarnings("ignore", module=r"tf_keras.*")


def import_tf_keras_quietly():
    """Imports tf_keras and TFMOT (which re-register TensorFlow's C++ logging).

    Off the main thread (a reference built while training goes on) file
    descriptor 2 is left alone: silencing it would hide what the main thread
    prints meanwhile, and with TensorFlow imported already these imports
    print nothing (Keras 3.15 / TF 2.21).
    """
    quiet = "tf_keras" not in sys.modules and threading.current_thread() is threading.main_thread()
    with stderr_silenced() if quiet else contextlib.nullcontext():
        import tf_keras
        import tensorflow_model_optimization as tfmot
    return tf_keras, tfmot
