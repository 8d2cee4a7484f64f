"""What the report finds: table/head relations and runtime copies, shares of the parameters, what a session holds
(counted), and a folder's files related."""
