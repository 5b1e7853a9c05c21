"""Performance tools: `shardlm plan` (`planner`: every strategy compiled, read and ranked, with `hlo` reading the
compiled program and `costmodel` the step-time estimate), `shardlm bench` (`bench`), `shardlm profile`
(`profile`), and the strategies they share (`strategies`). FLOP counting and peaks are `shardlm.flops`."""
