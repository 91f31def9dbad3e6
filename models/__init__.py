from models.seq2seq import Seq2SeqTransformer
from models.toy import ToyModel

__all__ = ["Seq2SeqTransformer", "ToyModel"]
