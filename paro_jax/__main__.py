from paro_jax.cli import main

main()
