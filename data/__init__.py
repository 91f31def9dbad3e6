from data.random_data import RandomDataModule

__all__ = ["RandomDataModule"]
