"""Starting and retiring workers: local processes, a command template (ssh, netns), Ray actors; store-carried queues."""
