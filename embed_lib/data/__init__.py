"""The pairs: built-in tasks from the local mirror or the Hub (`tasks`) and your own pair files (`custom_tasks`)."""
