from data.random_data import RandomDataModule
from data.seq2seq import Seq2SeqDataModule

__all__ = ["RandomDataModule", "Seq2SeqDataModule"]
