package main

import (
	"context"

	"github.com/jackc/pgx/v5"
)

// runSQL runs one statement on its own connection (CREATE DATABASE cannot
// run inside the pool's transactions).
func runSQL(ctx context.Context, url, sql string) error {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	_, err = conn.Exec(ctx, sql)
	return err
}

// runQuery runs a query that returns one row and scans it into dest.
func runQuery(ctx context.Context, url, sql string, dest ...any) error {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	return conn.QueryRow(ctx, sql).Scan(dest...)
}
