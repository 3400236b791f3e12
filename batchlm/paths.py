"""Where the project's own files are: the checkout this package is installed from (editable install)."""

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_REPOSITORY = PROJECT_ROOT / "model_repository"
DEFAULT_MODEL_DIR = PROJECT_ROOT / "models" / "default"
