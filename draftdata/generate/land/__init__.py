"""What the output keeps of a run: the usable answers landed on the budget by the dataset's rule (selection.py, a
pure function of the requests and the rows the store holds), the stage's outputs and figures written from them
(output.py), and the ledger of the prompts it holds no line of (rejected.py)."""
