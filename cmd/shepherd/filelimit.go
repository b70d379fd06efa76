package main

import (
	"context"
	"log/slog"
	"syscall"
)

// raiseFileLimit raises the process's soft open-file limit to its hard
// limit and logs both, for `shepherd run` and `shepherd dev`: the callback
// server holds a descriptor per agent, and an operator who sees accepts
// fail for lack of descriptors (shepherd_server_accept_errors_total) finds
// here what the process had.
//
// The Go runtime (package syscall's init, since Go 1.19, still so in 1.26)
// already raises the soft limit at start, but to one below the hard limit,
// and gives processes it starts the original soft limit back. Shepherd
// raises it explicitly, so that the limit it runs with and logs is the
// hard limit the operator set (the systemd unit's LimitNOFILE) whatever
// the runtime does. Its one child process, shepherd dev's PostgreSQL,
// inherits the raised limit, which it does not mind: it bounds its own
// files (max_files_per_process).
func raiseFileLimit(ctx context.Context, log *slog.Logger) {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		log.WarnContext(ctx, "reading the open-file limit", "err", err)
		return
	}
	if lim.Cur < lim.Max {
		raised := lim
		raised.Cur = raised.Max
		if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &raised); err != nil {
			log.WarnContext(ctx, "raising the open-file limit to the hard limit", "err", err, "soft", lim.Cur, "hard", lim.Max)
			return
		}
		lim = raised
	}
	log.InfoContext(ctx, "open-file limit", "soft", lim.Cur, "hard", lim.Max)
}
