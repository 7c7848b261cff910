"""Helpers shared by the tests, one module per subject.

``waits`` (``until``, ``until_blocking``, ``error_of``), ``net`` (``free_port``, ``refused_port``), ``serving`` (a
client of a server under test), ``generator`` (a fake engine behind a real GeneratorService), ``fake_vllm`` (a
stand-in of vLLM's collective_rpc and weight loading, for the weight-sync tests),
``loop`` (stand-ins of the loop's clients), ``learner`` (batches, scripts under torchrun), ``pki``
(a throwaway CA), ``deploy`` (checks of the files in deploy/), ``child`` (a function run in a
fresh process: its answer, or why not, within a bound); and what other processes load by
name: ``learner_ranks`` (``python -m``), ``reward_plugins`` and ``reward_fragile`` (scorer plugins),
``env_plugins`` (environment plugins).
"""
