from models.aux_head import AuxHeadModel
from models.seq2seq import Seq2SeqTransformer
from models.toy import ToyModel

__all__ = ["AuxHeadModel", "Seq2SeqTransformer", "ToyModel"]
