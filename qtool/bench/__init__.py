"""`qtool bench`: kernel and end-to-end measurements against cuBLAS FP16/INT8/FP8 and the card's ceilings."""
