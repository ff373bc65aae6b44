"""Egeria: knowledge-guided layer freezing for Keras (EuroSys 2023)."""

from tf_hwopt.egeria.modules import Module, describe_modules, partition_modules
