"""Step 2, generate: prompts to answers, landed on the dataset's token budget. A run goes through three rooms, each
using only the ones before it and the shared floor:

- plan/: what a run asks, made before any request (`Plan`): the requests in prompt order, or each conversation
  walked over the turns the store holds, with the store's rows for them;
- run/: one run (`run_generation`, returning a `RunResult`): the checks before it sends, the dispatcher, its
  ledger, the budget controller, the work queue and the exact rule as it goes;
- land/: what the output keeps (`select_responses`, pure) and the stage's outputs written from it.

Beneath them: the request keys (request.py), the response store (store.py), what a stored answer counts
(accounting.py), and the engines a run talks to (backends/, embedded/), which know nothing of the rest.
"""
