from models.toy import ToyModel

__all__ = ["ToyModel"]
