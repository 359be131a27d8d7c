"""``python -m tests.helpers.qwen3vl_cli ...`` (what ``torchrun -m tests.helpers.qwen3vl_cli`` runs): the
``diffgrpo`` command line with :func:`tests.helpers.pipelines.qwen3vl_image_only_processor` applied, so that a
Qwen-Image 2.1 pipeline directory loads where torchvision is missing."""
import sys

from diffgrpo.cli.app import main
from tests.helpers.pipelines import qwen3vl_image_only_processor

if __name__ == "__main__":
    with qwen3vl_image_only_processor():
        code = main()
    sys.exit(code)
