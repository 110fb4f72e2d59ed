"""minibert: a readable, exact BERT encoder in PyTorch."""

from .config import BertConfig
from .loading import CheckpointError
from .model import BertModel, BertOutput
from .tokenizer import BertTokenizer

__all__ = ["BertConfig", "BertModel", "BertOutput", "BertTokenizer", "CheckpointError"]
__version__ = "0.1.0"
