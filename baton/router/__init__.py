"""`baton router`: OpenAI routes in front of many workers, each request sent where its prefix is
cached (weighed against load) or in turn; workers join and leave at run time, and a worker that
dies is taken out while its requests move on. With prefill workers, it is also the PD front."""
