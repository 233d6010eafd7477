"""Domain parallelism: a spatial domain (an image, a volume, a video) split across the ranks of one
or more mesh axes, each rank holding its block, every layer that looks at neighbours exchanging a
halo (:func:`fastdist.halo_exchange`).

``conv`` (`DomainConv`: one convolution, one split dim, uneven blocks), ``windows`` (the layer
computations on a rank's block: convolutions, transposed convolutions, pooling, upsampling),
``norms`` (group / batch / instance norms with statistics over the whole domain),
``attention`` (self-attention over spatial tokens: the keys gathered over the split axes, or
passed around a ring),
``adaptive`` (adaptive and global pooling), ``layers``
(which modules a region holds, and the forward each gets) and ``style``
(`DomainParallel`: a whole unmodified conv net made domain-parallel by ``fastdist.nn.parallelize``).
"""

from fastdist.nn.domain.conv import DomainConv
from fastdist.nn.domain.style import DomainParallel

__all__ = ["DomainConv", "DomainParallel"]
