package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/meilisearch/meilisearch-go"
	"github.com/minio/minio-go/v7"
	"github.com/riverqueue/river"
)

// The orders demo's jobs. Each worker must be idempotent: River runs a job
// again after a crash.

// indexOrderArgs: order.created → the order in Meilisearch.
type indexOrderArgs struct {
	OrderID int64 `json:"orderId"`
}

func (indexOrderArgs) Kind() string { return "indexOrder" }

// writeReceiptArgs: order.created → a sealed receipt object in S3.
type writeReceiptArgs struct {
	OrderID int64 `json:"orderId"`
}

func (writeReceiptArgs) Kind() string { return "writeReceipt" }

// reportArgs is one report, on a cron tick or by hand.
type reportArgs struct{ CronRun }

func (reportArgs) Kind() string { return "report" }

// indexOrder puts the order into the Meilisearch index (replacing any earlier copy).
func indexOrder(d workDeps, ctx context.Context, job *river.Job[indexOrderArgs]) error {
	if d.search == nil {
		return nil // search not configured: nothing to index into
	}
	o, err := loadOrder(ctx, d.db, job.Args.OrderID)
	if err != nil {
		return err
	}
	pk := "id"
	ctx, cancel := d.external(ctx)
	defer cancel()
	if _, err := d.search.Index(ordersIndex).AddDocuments(ctx, []order{o}, &meilisearch.DocumentOptions{PrimaryKey: &pk}); err != nil {
		return fmt.Errorf("indexing order %d: %w", o.ID, err)
	}
	return nil
}

// writeReceipt stores the order's receipt in S3, sealed with the master key:
// the object store never sees a customer's order in the clear.
func writeReceipt(d workDeps, ctx context.Context, job *river.Job[writeReceiptArgs]) error {
	if d.storage == nil {
		return nil
	}
	o, err := loadOrder(ctx, d.db, job.Args.OrderID)
	if err != nil {
		return err
	}
	plain, _ := json.Marshal(o)
	name := fmt.Sprintf("receipts/%d.sealed", o.ID)
	sealed := d.masterKey.seal(plain, []byte(name))
	ctx, cancel := d.external(ctx)
	defer cancel()
	_, err = d.storage.PutObject(ctx, d.bucket, name, bytes.NewReader(sealed), int64(len(sealed)),
		minio.PutObjectOptions{ContentType: "application/octet-stream", UserMetadata: map[string]string{"Key-Id": d.masterKey.id}})
	if err != nil {
		return fmt.Errorf("writing %s: %w", name, err)
	}
	return nil
}

// writeReport counts the orders so far and stores the count as
// reports/<scheduled time>.json (the same tick always writes the same object).
func writeReport(d workDeps, ctx context.Context, job *river.Job[reportArgs]) error {
	var orders, pending int64
	err := d.db.QueryRow(ctx, `SELECT (SELECT count(*) FROM orders),
		(SELECT count(*) FROM outbox_events WHERE delivered_at IS NULL AND dead_at IS NULL)`).Scan(&orders, &pending)
	if err != nil {
		return fmt.Errorf("counting for the report: %w", err)
	}
	report, _ := json.Marshal(map[string]any{"scheduledAt": job.Args.ScheduledAt, "manual": job.Args.Manual,
		"orders": orders, "pendingEvents": pending, "fencingToken": job.Args.FencingToken})
	if d.storage == nil {
		d.log.WithField("report", string(report)).Info("report (no S3 configured)")
		return nil
	}
	name := "reports/" + job.Args.ScheduledAt.UTC().Format(time.RFC3339Nano) + ".json"
	ctx, cancel := d.external(ctx)
	defer cancel()
	_, err = d.storage.PutObject(ctx, d.bucket, name, bytes.NewReader(report), int64(len(report)),
		minio.PutObjectOptions{ContentType: "application/json"})
	if err != nil {
		return fmt.Errorf("writing %s: %w", name, err)
	}
	return nil
}

func loadOrder(ctx context.Context, db *pgxpool.Pool, id int64) (order, error) {
	o, err := scanOrder(db.QueryRow(ctx, `SELECT `+orderColumns+` FROM orders WHERE id = $1`, id))
	if err != nil {
		return order{}, fmt.Errorf("loading order %d: %w", id, err)
	}
	return o, nil
}
