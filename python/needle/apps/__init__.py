"""The repository's apps/ (models, simple_ml, mlp_resnet) as `needle.apps`, for an installed needle.

    from needle.apps.models import LanguageModel
    from needle.apps.simple_ml import train_ptb, evaluate_ptb

The course's way, `sys.path.append("./apps")` then `from models import LanguageModel`, needs the working
directory to be the repository; this one works from anywhere once `pip install -e .` has installed needle. It
holds no code of its own: the package's search path is the repository's apps/ folder, so `needle.apps.models` is
apps/models.py itself (edit it there). An editable install imports needle from python/needle/, two levels below
that folder; a wheel carries no apps/, and importing a submodule then fails with ModuleNotFoundError.
"""
from pathlib import Path

_APPS = Path(__file__).resolve().parents[3] / "apps"  # python/needle/apps/__init__.py -> <repository>/apps

if _APPS.is_dir():
    __path__.append(str(_APPS))  # the search path of this package, which the import system set
