"""OrbitKV's lab: what studies the method, outside the serving wheel (``pip install -e lab``).

``checks`` (``orbitkv check operator|window|batch-variance|step-split``), ``fidelity`` (``orbitkv
fidelity``), ``binding`` (the binding model: task, training, evaluation, its weights under
``assets/binding``) and ``fleet`` (the compose file's services as local processes). It imports
``orbitkv``; ``orbitkv`` never imports it.
"""
