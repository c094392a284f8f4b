"""The course's applications: models (ResNet9, LanguageModel), MLPResNet on MNIST, and the training helpers.

Importable as a package from the repository root (`from apps.models import ResNet9`) or, as in the course
notebooks, with `sys.path.append("./apps")` (`from models import LanguageModel`, `from simple_ml import *`).
"""
