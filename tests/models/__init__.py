"""Writers of test models: random-weight GGUFs of real shapes (``cuda_testmodel``)."""
