from resources.clip import ClipResource
from resources.dataset import DatasetResource
from resources.nemo import NemoEncoders

__all__ = ["ClipResource", "DatasetResource", "NemoEncoders"]
