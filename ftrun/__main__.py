from ftrun.cli import main

main()
