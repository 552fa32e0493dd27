//! The trace readers, format by format, through the one reading path.

use std::io::Read;

use super::*;

#[test]
fn every_format_numbers_its_records_bad_ones_included_and_keeps_their_hashes() {
    // Two bad lines skipped (lines 3 and 4): the requests keep their positions as rids.
    let text = "arrival_ms,prompt_tokens,output_tokens,hash_ids\n100,600,3,7 8\n1,x,1,\n2,0,1,\n150.5,10,3,\n";
    let t = Trace::read(
        "t.csv".into(),
        TraceFormat::GenericCsv,
        text.as_bytes(),
        ReadOptions {
            limit: None,
            skip_bad_lines: true,
        },
    )
    .unwrap();
    assert_eq!(t.format, TraceFormat::GenericCsv);
    assert_eq!(t.format.to_string(), "generic CSV");
    assert_eq!(
        t.requests
            .iter()
            .map(|r| (r.rid, r.line, r.arrival_ms))
            .collect::<Vec<_>>(),
        [(0, 2, 0.0), (3, 5, 50.5)]
    );
    assert_eq!(t.hashes(&t.requests[0]), [7, 8]);
    assert!(t.hashes(&t.requests[1]).is_empty());
    assert!(t.has_hashes());
    assert_eq!((t.skipped_lines, t.bad_line_examples.len()), (2, 2));
    // A length-only file read without arrivals is refused.
    let e = Trace::read(
        "x".into(),
        TraceFormat::LengthsCsv,
        &b"num_prefill_tokens,num_decode_tokens\n5,1\n"[..],
        ReadOptions::default(),
    )
    .unwrap_err();
    assert!(matches!(e, TraceError::NeedsArrivals { .. }), "{e}");
}

#[test]
fn a_csv_line_beyond_the_limit_stops_the_read_naming_its_line() {
    let text = format!(
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.0,10,2\n2023-11-16 18:17:04.0,{},2\n",
            "9".repeat(MAX_LINE_BYTES)
        );
    let e = Trace::read(
        "t.csv".into(),
        TraceFormat::AzureCsv,
        text.as_bytes(),
        ReadOptions::default(),
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        format!("trace `t.csv`:3: the line is longer than {MAX_LINE_BYTES} bytes")
    );
}

#[test]
fn a_mooncake_line_beyond_the_limit_is_a_bad_line() {
    let text = format!(
            "{{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 2, \"hash_ids\": [1]}}\n{}\n{{\"timestamp\": 1, \"input_length\": 10, \"output_length\": 2, \"hash_ids\": [2]}}\n",
            " ".repeat(MAX_LINE_BYTES + 1)
        );
    let opts = ReadOptions {
        limit: None,
        skip_bad_lines: true,
    };
    let t = Trace::read(
        "t.jsonl".into(),
        TraceFormat::MooncakeJsonl,
        text.as_bytes(),
        opts,
    )
    .unwrap();
    assert_eq!((t.requests.len(), t.skipped_lines), (2, 1));
    assert_eq!(
        t.bad_line_examples,
        [format!(
            "t.jsonl:2: `line` is longer than {MAX_LINE_BYTES} bytes"
        )]
    );
}

#[test]
fn wall_clock_timestamps_parse_to_ns() {
    let a = parse_wall_clock("2023-11-16 18:17:03.9799600").unwrap();
    let b = parse_wall_clock("2023-11-16 18:17:04.0319600").unwrap();
    assert_eq!(b - a, 52_000_000);
    assert_eq!(parse_wall_clock("1970-01-01 00:00:00").unwrap(), 0);
    assert_eq!(
        parse_wall_clock("2023-11-17 00:00:00.5").unwrap()
            - parse_wall_clock("2023-11-16 23:59:59.5").unwrap(),
        1_000_000_000
    );
    for bad in [
        "2023-11-16",
        "2023-13-01 00:00:00",
        "2023-02-29 00:00:00",
        "2023-11-16 24:00:00",
        "2023-11-16 18:17:03.1234567890",
        "2023-11-16 18:17:-3",
        "x-y-z 1:2:3",
    ] {
        assert!(parse_wall_clock(bad).is_err(), "{bad}");
    }
}

#[test]
fn csv_with_bom_crlf_and_reordered_columns_reads() {
    let text = "\u{feff}GeneratedTokens, TIMESTAMP ,ContextTokens\r\n\
                    3,2023-11-16 18:17:03.9799600,100\r\n\
                    0,2023-11-16 18:17:04.0799600,7\r\n";
    let t = Trace::read(
        "t.csv".into(),
        TraceFormat::AzureCsv,
        text.as_bytes(),
        ReadOptions::default(),
    )
    .unwrap();
    let got: Vec<(u64, f64, u32, u32)> = t
        .requests
        .iter()
        .map(|r| (r.rid, r.arrival_ms, r.input_tokens, r.output_tokens))
        .collect();
    assert_eq!(got, [(0, 0.0, 100, 3), (1, 100.0, 7, 0)]);
    assert!(!t.has_hashes());
}

#[test]
fn limit_stops_reading_and_hashes_stay_with_their_request() {
    let text = "{\"timestamp\": 3, \"input_length\": 513, \"output_length\": 2, \"hash_ids\": [4, 5]}\n\
                    {\"timestamp\": 9, \"input_length\": 1, \"output_length\": 2, \"hash_ids\": [6]}\n\
                    not json\n";
    let t = Trace::read(
        "t.jsonl".into(),
        TraceFormat::MooncakeJsonl,
        text.as_bytes(),
        ReadOptions {
            limit: Some(2),
            skip_bad_lines: false,
        },
    )
    .unwrap();
    assert_eq!(t.requests.len(), 2);
    assert_eq!(t.hashes(&t.requests[0]), &[4, 5]);
    assert_eq!(t.hashes(&t.requests[1]), &[6]);
    // Relative to the first request, as Azure's.
    assert_eq!(t.requests[0].arrival_ms, 0.0);
    assert_eq!(t.requests[1].arrival_ms, 6.0);
}

fn generic(text: &str) -> Result<Trace, TraceError> {
    read_generic_csv("t.csv".into(), text.as_bytes(), ReadOptions::default())
}

fn read_generic_csv(file: String, reader: &[u8], opts: ReadOptions) -> Result<Trace, TraceError> {
    Trace::read(file, TraceFormat::GenericCsv, reader, opts)
}

fn read_lengths_csv(
    file: String,
    reader: &[u8],
    arrivals: &Arrivals,
    seed: u64,
    opts: ReadOptions,
) -> Result<Trace, TraceError> {
    let reader = Bounded::new(reader, LIMITS);
    read_bounded(
        file,
        TraceFormat::LengthsCsv,
        reader,
        Some(arrivals),
        seed,
        opts,
    )
}

fn bad_line(r: Result<Trace, TraceError>) -> BadLine {
    match r {
        Err(TraceError::BadLine(b)) => b,
        other => panic!("expected a bad line, got {other:?}"),
    }
}

fn rows(t: &Trace) -> Vec<(u64, f64, u32, u32, Vec<u64>)> {
    t.requests
        .iter()
        .map(|r| {
            (
                r.line,
                r.arrival_ms,
                r.input_tokens,
                r.output_tokens,
                t.hashes(r).to_vec(),
            )
        })
        .collect()
}

#[test]
fn generic_csv_with_bom_crlf_reordered_columns_and_hashes_reads() {
    let text = "\u{feff}output_tokens, Arrival_MS ,prompt_tokens,hash_ids,extra\r\n\
                    3,0,100,7,x\r\n\
                    \r\n\
                    0,12.5,513,  8 9 ,y\r\n\
                    5,12.5,1,,z\r\n";
    let r = generic(text).unwrap();
    assert_eq!(
        rows(&r),
        [
            (2, 0.0, 100, 3, vec![7]),
            (4, 12.5, 513, 0, vec![8, 9]),
            (5, 12.5, 1, 5, vec![]),
        ]
    );
    assert!(r.has_hashes());
    assert_eq!(r.format, TraceFormat::GenericCsv);
}

#[test]
fn generic_csv_without_hash_column_reads_and_limit_stops() {
    let text = "arrival_ms,prompt_tokens,output_tokens\n1,2,3\n4,5,6\nnot,a,line\n";
    let r = read_generic_csv(
        "t.csv".into(),
        text.as_bytes(),
        ReadOptions {
            limit: Some(2),
            skip_bad_lines: false,
        },
    )
    .unwrap();
    assert_eq!(r.requests.len(), 2);
    assert!(!r.has_hashes());
}

#[test]
fn a_missing_column_in_the_header_is_named() {
    let b = bad_line(generic("arrival_ms,prompt_tokens\n1,2\n"));
    assert_eq!((b.line, b.field.as_str()), (1, "output_tokens"));
    assert!(b.problem.contains("column is missing"), "{}", b.problem);
}

#[test]
fn bad_values_are_named_by_line_and_column() {
    let h = "arrival_ms,prompt_tokens,output_tokens,hash_ids\n";
    for (row, field, words) in [
        ("1,2", "output_tokens", "is missing"),
        ("1,,3", "prompt_tokens", "is missing"),
        ("1,-5,3", "prompt_tokens", "whole number"),
        ("1,5,-1", "output_tokens", "whole number"),
        ("1,0,3", "prompt_tokens", "between 1 and 16777216"),
        ("1,16777217,3", "prompt_tokens", "between 1 and 16777216"),
        (
            "1,99999999999999999999999,3",
            "prompt_tokens",
            "between 1 and",
        ),
        ("1,5,1048577", "output_tokens", "between 0 and 1048576"),
        ("1,5.5,3", "prompt_tokens", "whole number"),
        ("-1,5,3", "arrival_ms", "between 0 and"),
        ("NaN,5,3", "arrival_ms", "between 0 and"),
        ("inf,5,3", "arrival_ms", "between 0 and"),
        ("1e300,5,3", "arrival_ms", "between 0 and"),
        ("1,5,3,1 2", "hash_ids", "needs ceil(5/512) = 1"),
        ("1,5,3,x", "hash_ids", "entry 0"),
        ("1,5,3,-4", "hash_ids", "entry 0"),
    ] {
        let b = bad_line(generic(&format!("{h}0,1,1\n{row}\n")));
        assert_eq!((b.line, b.field.as_str()), (3, field), "{row}: {b}");
        assert!(b.problem.contains(words), "{row}: {}", b.problem);
    }
    let b = bad_line(generic(&format!("{h}5,1,1\n4,1,1\n")));
    assert_eq!((b.line, b.field.as_str()), (3, "arrival_ms"));
    assert_eq!(
        b.to_string(),
        "t.csv:3: `arrival_ms` goes back in time: 4 ms, the request before arrived at 5 ms"
    );
}

#[test]
fn bad_lines_can_be_skipped_and_counted() {
    let text = "arrival_ms,prompt_tokens,output_tokens\n0,1,1\n1,x,1\n2,3,4\n\"open\n";
    let r = read_generic_csv(
        "t.csv".into(),
        text.as_bytes(),
        ReadOptions {
            limit: None,
            skip_bad_lines: true,
        },
    )
    .unwrap();
    assert_eq!(
        r.requests.iter().map(|r| r.line).collect::<Vec<_>>(),
        [2, 4]
    );
    assert!(r.skipped_lines >= 1);
    assert!(r.bad_line_examples[0].starts_with("t.csv:3: `prompt_tokens`"));
    let all_bad = read_generic_csv(
        "t.csv".into(),
        "arrival_ms,prompt_tokens,output_tokens\n0,0,1\n".as_bytes(),
        ReadOptions {
            limit: None,
            skip_bad_lines: true,
        },
    );
    assert!(
        matches!(all_bad, Err(TraceError::Empty { skipped: 1, .. })),
        "{all_bad:?}"
    );
}

#[test]
fn invalid_utf8_is_a_bad_line() {
    let mut text = b"arrival_ms,prompt_tokens,output_tokens\n0,1,1\n".to_vec();
    text.extend_from_slice(b"1,\xff,1\n");
    let r = read_generic_csv("t.csv".into(), &text[..], ReadOptions::default());
    let b = bad_line(r);
    assert_eq!((b.line, b.field.as_str()), (3, "line"));
}

#[test]
fn lengths_csv_gets_seeded_generated_arrivals() {
    let text = "\u{feff}num_prefill_tokens,num_decode_tokens,pd_ratio\r\n\
                    100,20,5\r\n300,0,inf\r\n7,1,7\r\n";
    let a: Arrivals = "poisson:4".parse().unwrap();
    let read = |seed| {
        read_lengths_csv(
            "l.csv".into(),
            text.as_bytes(),
            &a,
            seed,
            ReadOptions::default(),
        )
        .unwrap()
    };
    let r = read(9);
    assert_eq!(
        r.requests
            .iter()
            .map(|r| (r.line, r.input_tokens, r.output_tokens))
            .collect::<Vec<_>>(),
        [(2, 100, 20), (3, 300, 0), (4, 7, 1)]
    );
    // Generated, then counted from the first request, as every format's arrivals.
    let times: Vec<f64> = r.requests.iter().map(|r| r.arrival_ms).collect();
    let generated = a.times_ms(3, 9).unwrap();
    let from_first: Vec<f64> = generated.iter().map(|t| t - generated[0]).collect();
    assert_eq!(times, from_first);
    assert_eq!(read(9), r);
    assert_ne!(read(10), r);
    let b = bad_line(read_lengths_csv(
        "l.csv".into(),
        "num_prefill_tokens,num_decode_tokens\n5\n".as_bytes(),
        &a,
        1,
        ReadOptions::default(),
    ));
    assert_eq!((b.line, b.field.as_str()), (2, "num_decode_tokens"));
    let b = bad_line(read_lengths_csv(
        "l.csv".into(),
        "num_prefill_tokens\n5\n".as_bytes(),
        &a,
        1,
        ReadOptions::default(),
    ));
    assert_eq!((b.line, b.field.as_str()), (1, "num_decode_tokens"));
}

#[test]
fn headers_tell_the_format_and_the_override_wins() {
    let cases: [(&[u8], Option<TraceFormat>); 7] = [
        (
            b"\xef\xbb\xbfTIMESTAMP,ContextTokens,GeneratedTokens\r\n",
            Some(TraceFormat::AzureCsv),
        ),
        (
            b"{\"timestamp\": 1, \"input_length\": 2}\n",
            Some(TraceFormat::MooncakeJsonl),
        ),
        (
            b"arrival_ms,prompt_tokens,output_tokens,hash_ids\n",
            Some(TraceFormat::GenericCsv),
        ),
        (
            b"\"num_prefill_tokens\",\"num_decode_tokens\"",
            Some(TraceFormat::LengthsCsv),
        ),
        (b"a,b,c\n", None),
        (b"", None),
        (b"\xff\xfe", None),
    ];
    for (head, want) in cases {
        assert_eq!(TraceFormat::from_header(head), want, "{head:?}");
    }
    for f in TraceFormat::ALL {
        assert_eq!(f.name().to_uppercase().parse::<TraceFormat>().unwrap(), f);
    }
    let e = "csv".parse::<TraceFormat>().unwrap_err();
    assert!(e.to_string().contains("expected one of `azure`"), "{e}");

    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.txt");
    std::fs::write(&p, "num_prefill_tokens,num_decode_tokens\n1,1\n").unwrap();
    assert_eq!(choose_format(&p, None).unwrap(), TraceFormat::LengthsCsv);
    assert_eq!(
        choose_format(&p, Some(TraceFormat::GenericCsv)).unwrap(),
        TraceFormat::GenericCsv
    );
    let j = dir.path().join("t.jsonl");
    std::fs::write(&j, "\n").unwrap();
    assert_eq!(choose_format(&j, None).unwrap(), TraceFormat::MooncakeJsonl);
    let u = dir.path().join("u.csv");
    std::fs::write(&u, "x,y\n").unwrap();
    assert!(matches!(
        choose_format(&u, None),
        Err(TraceError::Unknown { .. })
    ));
    assert!(matches!(
        choose_format(dir.path(), None),
        Err(TraceError::NotAFile { .. })
    ));
}

#[test]
fn read_path_needs_arrivals_exactly_for_length_only_traces() {
    let dir = tempfile::tempdir().unwrap();
    let l = dir.path().join("l.csv");
    std::fs::write(&l, "num_prefill_tokens,num_decode_tokens\n1,1\n2,2\n").unwrap();
    let g = dir.path().join("g.csv");
    std::fs::write(&g, "arrival_ms,prompt_tokens,output_tokens\n0,1,1\n").unwrap();
    let a: Arrivals = "gamma:2:3".parse().unwrap();
    let opts = ReadOptions::default();
    assert_eq!(
        Trace::load(&l, Some(TraceFormat::LengthsCsv), Some(&a), 1, opts)
            .unwrap()
            .requests
            .len(),
        2
    );
    assert!(matches!(
        Trace::load(&l, Some(TraceFormat::LengthsCsv), None, 1, opts),
        Err(TraceError::NeedsArrivals { .. })
    ));
    assert!(matches!(
        Trace::load(&g, Some(TraceFormat::GenericCsv), Some(&a), 1, opts),
        Err(TraceError::HasArrivals { .. })
    ));
    assert_eq!(
        Trace::load(&g, Some(TraceFormat::GenericCsv), None, 1, opts)
            .unwrap()
            .requests[0]
            .input_tokens,
        1
    );
}

#[test]
fn a_line_longer_than_the_cap_stops_the_read_naming_it() {
    let mut text = b"arrival_ms,prompt_tokens,output_tokens,hash_ids\n0,1,1,\n1,1,1,".to_vec();
    text.resize(text.len() + MAX_LINE_BYTES + 1, b'1');
    let r = read_generic_csv("t.csv".into(), &text[..], ReadOptions::default());
    assert!(
        matches!(r, Err(TraceError::LineTooLong { line: 3, .. })),
        "{r:?}"
    );
}

#[test]
fn an_endless_input_stops_at_the_file_cap() {
    // Short lines forever: only the file cap ends it (a small one, to keep the test quick).
    let endless = std::io::repeat(b'\n');
    let head = "arrival_ms,prompt_tokens,output_tokens\n".as_bytes();
    let limits = Limits {
        file_bytes: 1 << 20,
        line_bytes: 64,
    };
    let reader = Bounded::new(std::io::BufReader::new(head.chain(endless)), limits);
    let r = read_bounded(
        "zero".into(),
        TraceFormat::GenericCsv,
        reader,
        None,
        0,
        ReadOptions::default(),
    );
    assert!(matches!(r, Err(TraceError::TooLarge { .. })), "{r:?}");
    assert_eq!(
        TraceError::TooLarge {
            file: "zero".into()
        }
        .to_string(),
        "trace `zero` is larger than 4294967296 bytes"
    );
}

proptest::proptest! {
    #[test]
    fn no_input_makes_the_readers_panic(
        body in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..400),
        header in 0usize..3,
    ) {
        let head: &[u8] = match header {
            0 => b"arrival_ms,prompt_tokens,output_tokens,hash_ids\n",
            1 => b"num_prefill_tokens,num_decode_tokens\n",
            _ => b"",
        };
        let text = [head, &body].concat();
        let a = Arrivals::Poisson { qps: 1.0 };
        for skip_bad_lines in [false, true] {
            let opts = ReadOptions { limit: None, skip_bad_lines };
            if let Ok(r) = read_generic_csv("p.csv".into(), &text[..], opts) {
                proptest::prop_assert!(r.requests.windows(2).all(|w| w[0].arrival_ms <= w[1].arrival_ms));
                proptest::prop_assert!(r.requests.iter().all(|r| r.input_tokens >= 1));
            }
            let _ = read_lengths_csv("p.csv".into(), &text[..], &a, 1, opts);
        }
        let _ = TraceFormat::from_header(&text);
        let _ = String::from_utf8_lossy(&body).parse::<Arrivals>();
    }
}
