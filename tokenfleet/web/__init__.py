"""The gateway's pages for people: the chat page (`/`, `/chat`) and the operator console (`/console`). Static files
that ship inside the package (no CDN, no Node at run time) and use the public and admin APIs like any client."""
