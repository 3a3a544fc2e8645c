"""The local deployment (`splitserve serve`): what to start (plan) and the processes that run it."""
