import os
import sys

# PyTorch's CPU allocator reads THP_MEM_ALLOC_ENABLE once, at its first allocation (which importing torch
# makes): it has to be in the environment before torch is imported. Child processes inherit it.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from .suite import main  # noqa: E402  (after the environment is set)

sys.exit(main())
