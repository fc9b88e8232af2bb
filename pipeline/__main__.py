from pipeline.entry import main

# Guarded: engines that spawn worker processes re-import the main module.
if __name__ == "__main__":
    main()
