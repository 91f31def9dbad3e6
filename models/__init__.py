from models.aux_head import AuxHeadModel
from models.toy import ToyModel

__all__ = ["AuxHeadModel", "ToyModel"]
