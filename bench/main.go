// Command bench measures the performance figures of SPEC §7 and prints each
// on its own line:
//
//	P2 claim_finish_per_s value=3120 baseline=410 ratio=7.61 limit=5672 limit_ratio=0.55 workers=16
//
// It starts one private, durable PostgreSQL cluster and runs every figure
// (or those named in BENCH_ONLY, comma-separated) against it, so that a
// figure and its baseline are always measured on the same server in the same
// run. Run it with `make bench`. Figures are never asserted: the targets are
// printed next to them (limit=, limit_ratio=).
package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"runtime/pprof"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/shepherd/shepherd/internal/pgserver"
)

// figure is one measurement of SPEC §7.
type figure struct {
	id  string
	run func(ctx context.Context, e *env) error
}

var figures = []figure{
	{"P1", benchHeartbeats},
	{"P2", benchClaimFinish},
	{"P3", benchCandidateLatency},
	{"P4", benchTakeover},
	{"P5", benchMemory},
	{"P6", benchSilenceToReboot},
	{"P7", benchUIRender},
	{"P8", benchBMCRecovery},
}

// env is what every figure gets: the shared server and a way to get a fresh
// database on it.
type env struct {
	srv *pgserver.Server
	seq int
}

// database creates an empty database and returns its URL.
func (e *env) database(ctx context.Context, name string) (string, error) {
	e.seq++
	db := fmt.Sprintf("%s_%d", name, e.seq)
	if err := runSQL(ctx, e.srv.URL("postgres"), "CREATE DATABASE "+db); err != nil {
		return "", fmt.Errorf("creating database %s: %w", db, err)
	}
	return e.srv.URL(db), nil
}

func main() {
	if len(os.Args) > 1 && os.Args[1] == loadgenMode {
		os.Exit(loadgenMain(os.Args[2:]))
	}
	if len(os.Args) > 1 && os.Args[1] == p5LoadgenMode {
		os.Exit(p5LoadgenMain(os.Args[2:]))
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context) error {
	var only []string
	if v := os.Getenv("BENCH_ONLY"); v != "" {
		only = strings.Split(v, ",")
	}
	for _, id := range only {
		if !slices.ContainsFunc(figures, func(f figure) bool { return f.id == id }) {
			return fmt.Errorf("BENCH_ONLY names %q, which is not a figure", id)
		}
	}
	// Durable: the figures compare against pgbench on the same server, and
	// both should pay for real commits, as production does.
	srv, err := pgserver.Start(ctx, pgserver.Config{
		Durable:  true,
		Settings: map[string]string{"max_connections": "300"},
		Logger:   slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
	})
	if err != nil {
		return err
	}
	defer srv.Close()
	if path := os.Getenv("BENCH_CPUPROFILE"); path != "" {
		f, err := os.Create(path)
		if err != nil {
			return err
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	e := &env{srv: srv}
	failed := 0
	for _, f := range figures {
		if len(only) > 0 && !slices.Contains(only, f.id) {
			continue
		}
		start := time.Now()
		if err := f.run(ctx, e); err != nil {
			fmt.Fprintf(os.Stderr, "bench: %s: %v\n", f.id, err)
			failed++
			continue
		}
		fmt.Fprintf(os.Stderr, "bench: %s took %s\n", f.id, time.Since(start).Round(time.Second))
	}
	if failed > 0 {
		return fmt.Errorf("%d figures failed", failed)
	}
	return nil
}

// report prints one figure line: id, name, value, then key=value pairs.
func report(id, name string, value float64, kv ...any) {
	var b strings.Builder
	fmt.Fprintf(&b, "%s %s value=%s", id, name, num(value))
	for i := 0; i+1 < len(kv); i += 2 {
		fmt.Fprintf(&b, " %v=", kv[i])
		switch v := kv[i+1].(type) {
		case float64:
			b.WriteString(num(v))
		default:
			fmt.Fprint(&b, v)
		}
	}
	fmt.Println(b.String())
}

func num(v float64) string {
	switch {
	case v >= 100:
		return fmt.Sprintf("%.0f", v)
	case v >= 1:
		return fmt.Sprintf("%.2f", v)
	default:
		return fmt.Sprintf("%.3f", v)
	}
}

// artefactDir creates and returns a new directory for a figure's artefacts
// (profiles), under $BENCH_ARTEFACTS or the temporary directory, named by
// the figure and the time, so that runs do not overwrite each other's.
func artefactDir(figure string) (string, error) {
	root := os.Getenv("BENCH_ARTEFACTS")
	if root == "" {
		root = filepath.Join(os.TempDir(), "shepherd-bench-artefacts")
	}
	dir := filepath.Join(root, figure+"-"+time.Now().UTC().Format("20060102T150405Z"))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", fmt.Errorf("creating the %s artefact directory: %w", figure, err)
	}
	return dir, nil
}
